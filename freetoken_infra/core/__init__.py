"""The core: settings and their defaults, host layout, hardware classes, launch plan,
quantisation, manifest. Imports nothing above it (the import contract in pyproject.toml)."""
