"""``python -m forgetless`` (and ``accelerate launch -m forgetless``) runs the CLI."""

from forgetless.cli.app import main

if __name__ == "__main__":
    main()
