"""STAND-IN for freetoken/__main__.py (`python -m freetoken` = `ft serve`)."""

from .server import launch_server

assert __name__ == "__main__"

launch_server(prog="python -m freetoken")
