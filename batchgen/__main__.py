import sys

from batchgen.usage import early_exit

text = early_exit(sys.argv[1:])
if text is not None:
    print(text)
else:
    from batchgen.cli import main

    main()
