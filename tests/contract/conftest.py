def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "contract: runs our engine command lines through the real FreeToken parser "
        "(builds a ~5.7 GB venv on first use; FREETOKEN_CONTRACT=skip skips)",
    )
