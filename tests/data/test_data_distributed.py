"""Real gloo processes: data-parallel ranks that each call get_microbatch, all-gathered, reproduce the
single-process global batch in order (the property the PTD-P trainer's loss equivalence rests on)."""

import os
import subprocess
import sys
import textwrap

import torch

from ptdp.data import build_datasets, get_microbatch

WORKER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from ptdp.data import build_datasets, get_microbatch
    from ptdp.runtime.exit import exit_now

    rank, world, init, prefix, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dataset = build_datasets([prefix], "1,0,0", 8, seed=11).train
    B, b = 8, 2
    batches = []
    for iteration in range(6):
        local = torch.cat([get_microbatch(dataset, iteration, B, rank, world, b, j) for j in range(B // (world * b))])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        batches.append(torch.cat(gathered))
    if rank == 0:
        torch.save(torch.stack(batches), out)
    dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort
    """
)


def test_data_parallel_ranks_reassemble_the_global_batch(tmp_path):
    from ptdp.data import ByteTokenizer, IndexedDatasetWriter

    prefix = str(tmp_path / "c")
    writer = IndexedDatasetWriter(prefix, 257)
    for k in range(30):
        writer.add_document(ByteTokenizer().encode(f"doc {k} " * (k + 3)) + [256])
    writer.finalize()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    world, out = 2, str(tmp_path / "batches.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), init, prefix, out],
            env=env,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    try:
        errors = [p.communicate(timeout=90)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), errors
    dataset = build_datasets([prefix], "1,0,0", 8, seed=11).train
    reference = torch.stack([get_microbatch(dataset, k, 8, 0, 1, 8, 0) for k in range(6)])
    assert torch.equal(torch.load(out), reference)
