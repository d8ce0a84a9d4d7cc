"""The data and evaluation flags' problems: Megatron-LM's per-split datasets, ``--skip-train`` and
``--full-validation``, one line each naming the flag. Pure: the files themselves are checked at start-up.

Megatron's rules: ``--data-path`` (with ``--split``) and the per-split ``--train-data-path`` /
``--valid-data-path`` / ``--test-data-path`` are exclusive; each per-split flag takes ``--data-path``'s
forms. ptdp also needs the training data whenever a split is given its own (the checkpoint's data state
continues it, even under ``--skip-train``, which reads none of it).
"""

from __future__ import annotations

from ptdp.config.schema import Config

PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _split_shares(split: str) -> list[float] | None:
    """``--split``'s three proportions, or None when it does not parse (the data builder says so)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        return None
    return (parts + [0.0] * 3)[:3] if 0 < len(parts) <= 3 else None


def data_errors(config: Config) -> list[str]:
    """Every problem of the data and evaluation flags together."""
    d, tr = config.data, config.training
    per_split = [d.train_data_path, d.valid_data_path, d.test_data_path]
    errors = []
    if d.data_path and any(per_split):
        given = ", ".join(flag for flag, path in zip(PER_SPLIT_FLAGS, per_split) if path)
        errors.append(f"--data-path cannot be combined with {given} (as in Megatron-LM): give every split its own "
                      "datasets, or one --data-path divided by --split")
        return errors
    if any(per_split) and not d.train_data_path:
        errors.append("--valid-data-path and --test-data-path need --train-data-path too: the training data "
                      "(the checkpoint's data state continues it; --skip-train reads none of it)")
    if any(per_split):
        has_valid, has_test = bool(d.valid_data_path), bool(d.test_data_path)
        where = "--valid-data-path"
    else:
        shares = _split_shares(d.split)
        has_valid, has_test = (shares[1] > 0, shares[2] > 0) if shares else (True, True)
        where = f"a validation share in --split (it is {d.split})"
    if d.sft_truncate and not d.sft:
        errors.append("--sft-truncate applies only with --sft")
    if d.sft and not (d.data_path or d.train_data_path):
        errors.append("--sft trains on chat data: give --data-path PREFIX (written by `ptdp preprocess --sft`)")
    if d.sft and d.eod_mask_loss:
        errors.append("--sft with --eod-mask-loss: --sft's loss mask (assistant tokens only) already leaves out "
                      "everything else; drop --eod-mask-loss")
    if tr.full_validation and not has_valid:
        errors.append(f"--full-validation evaluates the whole validation split: give it one ({where})")
    if tr.skip_train and not (has_valid or has_test):
        errors.append("--skip-train evaluates the validation and test splits, and there are none: give "
                      + ("--valid-data-path or --test-data-path" if any(per_split) else
                         f"--split validation or test shares (it is {d.split})"))
    return errors
