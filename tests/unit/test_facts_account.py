"""facts/account.py: the passwd entry, read the way the fact reads it (real sh, real getent)."""

from __future__ import annotations

import subprocess

from facts.account import Account


def lines(command: str) -> list[str]:
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    return out.split("\n")[:-1] if out.endswith("\n") else out.split("\n")


def test_an_existing_account_and_a_missing_one():
    fact = Account()
    root = fact.process(lines(fact.command("root")))
    assert root is not None and root["uid"] == 0 and root["home"] == "/root" and root["name"] == "root"
    assert fact.process(lines(fact.command("no-such-account-here"))) is None
    assert fact.process([]) is None


def test_a_name_is_one_word_and_a_broken_entry_is_no_account():
    fact = Account()
    assert fact.process(lines(fact.command("root; echo x:x:0:0::/:/bin/sh"))) is None
    assert fact.process(["freetoken:x:999:abc:FreeToken:/var/lib/freetoken:/usr/sbin/nologin"]) is None
    entry = fact.process(["freetoken:x:999:988:FreeToken:/var/lib/freetoken:/usr/sbin/nologin"])
    assert entry == {
        "name": "freetoken",
        "uid": 999,
        "gid": 988,
        "home": "/var/lib/freetoken",
        "shell": "/usr/sbin/nologin",
    }
