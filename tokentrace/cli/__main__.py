"""``python -m tokentrace.cli``: the same as the ``tokentrace`` command."""

from tokentrace.cli import main

if __name__ == "__main__":
    main()
