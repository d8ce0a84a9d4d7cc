import sys

from ptdp.runtime.interrupt import install_for_command

# Ctrl-C from the first line on: one line and exit 130, never a KeyboardInterrupt traceback (main()
# does the same for the `ptdp` console script).
install_for_command(sys.argv[1:])

from ptdp.cli.main import main  # noqa: E402

sys.exit(main())
