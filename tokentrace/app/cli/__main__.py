"""``python -m tokentrace.app.cli``: the same as the ``tokentrace`` command."""

from tokentrace.app.cli import main

if __name__ == "__main__":
    main()
