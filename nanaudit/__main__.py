"""`python -m nanaudit`: the same as the `nanaudit` console script."""

from nanaudit.cli import main

if __name__ == "__main__":
    main()
