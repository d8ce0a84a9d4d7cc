import signal
import sys

from ptdp.runtime.interrupt import quiet_exit_handler

# Ctrl-C before a command installs its own handling (imports, argument parsing, or a command without a
# graceful stop): one line and exit 130, not a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, quiet_exit_handler("ptdp" + (f" {sys.argv[1]}" if len(sys.argv) > 1
                                                          and not sys.argv[1].startswith("-") else "")))

from ptdp.cli.main import main  # noqa: E402

sys.exit(main())
