import sys

from batchgen.cli.usage import early_exit

text = early_exit(sys.argv[1:])
if text is not None:
    print(text)
else:
    from batchgen.bytecode_cache import use_bytecode_cache

    use_bytecode_cache()  # before Hydra and torch are imported
    from batchgen.cli.main import main

    main()
