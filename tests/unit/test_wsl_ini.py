"""freetoken_infra.core.wsl_ini: .wslconfig / wsl.conf as WSL's own parser reads them
(microsoft/WSL src/shared/configfile/configfile.cpp), and the merge that keeps every other byte."""

from __future__ import annotations

import pytest

from freetoken_infra.core import wsl_ini
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.wsl_ini import WSLCONF, WSLCONFIG, merge, parse

WANT = Settings().wslconfig_values()  # memory=24GB processors=8 swap=4GB ...


def values(data: bytes, dialect: wsl_ini.Dialect = WSLCONFIG) -> dict[str, dict[str, str]]:
    return parse(data, dialect).sections()


# --------------------------------------------------------------------------- reading


def test_inline_comment_ends_a_value():
    assert values(b"[wsl2]\nmemory=4GB   # limit\n") == {"wsl2": {"memory": "4GB"}}


def test_hash_inside_quotes_is_kept_and_quotes_go():
    assert values(b'[wsl2]\nnetworkingMode = "mirrored"\nx = "a # b " # c\n') == {
        "wsl2": {"networkingmode": "mirrored", "x": "a # b "}
    }


def test_backslash_escapes_and_an_invalid_escape():
    ini = parse(b"[wsl2]\nkernel=c:\\\\wslkernel\\\\bzImage\nswapFile=C:\\Temp\\swap.vhdx\n", WSLCONFIG)
    # `\\` is a backslash; `\T` is no escape: WSL skips that line (and warns).
    assert ini.sections() == {"wsl2": {"kernel": "c:\\wslkernel\\bzImage"}}
    assert [p.line for p in ini.problems] == [3]


def test_line_continuation():
    assert values(b"[wsl2]\nkernelCommandLine = a \\\n b\n") == {"wsl2": {"kernelcommandline": "a  b"}}


def test_an_invalid_continued_line_is_skipped_to_its_last_line():
    ini = parse(b"[wsl2]\nkernelCommandLine = a \\\n b \\q c\nmemory=4GB\n", WSLCONFIG)
    assert ini.sections() == {"wsl2": {"memory": "4GB"}} and [p.line for p in ini.problems] == [2]


def test_keys_before_the_first_section_are_ignored_not_an_error():
    ini = parse(b"memory=1GB\nsystemd=true\n[wsl2]\nswap=0\n", WSLCONFIG)
    assert ini.sections() == {"wsl2": {"swap": "0"}} and ini.problems == ()
    assert [e.section for e in ini.entries] == ["", "", "wsl2"]


def test_case_of_sections_and_keys_does_not_matter_and_the_first_duplicate_wins():
    ini = parse(b"[WSL2]\nMemory=16GB\n[wsl2]\nmemory=24GB\n", WSLCONFIG)
    assert ini.value("wsl2", "MEMORY") == "16GB"
    assert len(ini.duplicates("wsl2", "memory")) == 2


def test_experimental_networking_mode_is_read_and_the_first_place_wins():
    ini = parse(b"[experimental]\nnetworkingMode=mirrored\n", WSLCONFIG)
    assert ini.value("wsl2", "networkingMode") == "mirrored"
    # WSL's own test (test/windows/UnitTests.cpp): [wsl2] NAT first, [experimental] Mirrored
    # later is "Duplicated config key": NAT counts.
    ini = parse(b"[wsl2]\nnetworkingMode=NAT\n[experimental]\nnetworkingMode=Mirrored\n", WSLCONFIG)
    assert ini.value("wsl2", "networkingMode") == "NAT"


@pytest.mark.parametrize(
    "data",
    [
        b"\xef\xbb\xbf[wsl2]\r\nmemory=4GB\r\n",
        b"\xff\xfe" + "[wsl2]\r\nmemory=4GB\r\n".encode("utf-16-le"),
        b"[wsl2]\r\nmemory=4GB\r\n",
    ],
)
def test_bom_utf16_and_crlf(data):
    assert values(data) == {"wsl2": {"memory": "4GB"}}


def test_utf16_without_bom_is_unreadable_for_wsl():
    ini = parse("[wsl2]\r\nmemory=4GB\r\n".encode("utf-16-le"), WSLCONFIG)
    assert ini.sections() == {} and ini.error and "byte-order mark" in ini.error


def test_semicolon_is_no_comment():
    ini = parse(b"[wsl2]\n; memory=1GB\nmemory=4GB\n", WSLCONFIG)
    assert ini.sections() == {"wsl2": {"memory": "4GB"}} and [p.line for p in ini.problems] == [2]


def test_wsl_conf_stops_at_its_first_invalid_line():
    # The Linux side parses without CFG_SKIP_INVALID_LINES: the rest of the file is ignored.
    ini = parse(b"[network]\nhostname=x\n[boot ]\nsystemd=true\n", WSLCONF)
    assert ini.sections() == {"network": {"hostname": "x"}} and ini.stopped_at == 3
    # The same lines in .wslconfig: the bad line is skipped, the rest is read (under [network]).
    assert parse(b"[network]\nhostname=x\n[boot ]\nsystemd=true\n", WSLCONFIG).stopped_at is None


def test_wsl_conf_with_a_bom_is_ignored_by_wsl():
    ini = parse(b"\xef\xbb\xbf[boot]\nsystemd=true\n", WSLCONF)
    assert ini.sections() == {} and ini.stopped_at == 1
    assert "byte-order mark" in ini.problems[0].message


def test_drive_root():
    assert wsl_ini.drive_root(parse(b"[automount]\nroot = /\n", WSLCONF)) == "/"
    assert wsl_ini.drive_root(parse(b"[automount]\nroot = /win\n", WSLCONF)) == "/win/"
    assert wsl_ini.drive_root(parse(b"", WSLCONF)) == "/mnt/"
    assert wsl_ini.drive_root(parse(b"root = /\n[automount]\n", WSLCONF)) == "/mnt/"


# --------------------------------------------------------------------------- merging


def test_value_already_right_in_wsls_reading_is_not_rewritten():
    data = b'[wsl2]\nmemory=24GB # mine\nprocessors = "8"\nswap=4gb\r\nlocalhostForwarding=True\nvmIdleTimeout=0\n'
    result = merge(data, WSLCONFIG, "wsl2", WANT)
    assert result.data == data and result.changed == () and not result.writes


def test_only_the_differing_value_changes_comment_and_spacing_stay():
    data = b"# mine\r\n[wsl2]\r\nMemory = 16GB   # half my RAM\r\nguiApplications=false\r\n"
    result = merge(data, WSLCONFIG, "wsl2", {"memory": "24GB", "swap": "4GB"})
    assert result.data == (
        b"# mine\r\n[wsl2]\r\nMemory = 24GB   # half my RAM\r\nguiApplications=false\r\nswap=4GB\r\n"
    )
    assert result.changed == ("memory", "swap")


def test_keys_before_any_section_and_a_commented_header_do_not_crash_and_stay():
    data = b"systemd=true\n# [boot]\nfoo=bar\n"
    result = merge(data, WSLCONF, "boot", {"systemd": "true"})
    assert result.problem is None
    assert result.data == data + b"\n[boot]\nsystemd=true\n"
    assert parse(result.data, WSLCONF).value("boot", "systemd") == "true"


def test_duplicates_the_first_is_set_the_later_commented_out():
    data = b"[wsl2]\nmemory=1GB\n[boot]\nx=1\n[wsl2]\nmemory=2GB\n"
    result = merge(data, WSLCONFIG, "wsl2", {"memory": "24GB"})
    assert result.data == b"[wsl2]\nmemory=24GB\n[boot]\nx=1\n[wsl2]\n# memory=2GB\n"


def test_networking_mode_moves_from_experimental_to_wsl2_without_a_duplicate():
    data = b"[wsl2]\nmemory=24GB\n\n[experimental]\nautoMemoryReclaim=gradual\nnetworkingMode=NAT\n"
    result = merge(data, WSLCONFIG, "wsl2", {"networkingMode": "mirrored"})
    assert result.data == (
        b"[wsl2]\nmemory=24GB\nnetworkingMode=mirrored\n\n[experimental]\n"
        b"autoMemoryReclaim=gradual\n# networkingMode=NAT\n"
    )
    after = parse(result.data, WSLCONFIG)
    assert after.value("wsl2", "networkingMode") == "mirrored"
    assert len(after.duplicates("wsl2", "networkingMode")) == 1


def test_networking_mode_already_right_under_experimental_is_left_alone():
    data = b"[experimental]\nnetworkingMode=mirrored\n"
    assert merge(data, WSLCONFIG, "wsl2", {"networkingMode": "Mirrored"}).data == data


def test_utf16_bom_and_crlf_survive_a_merge():
    data = b"\xff\xfe" + "[wsl2]\r\nmemory=16GB\r\n".encode("utf-16-le")
    result = merge(data, WSLCONFIG, "wsl2", {"memory": "24GB"})
    assert result.data == b"\xff\xfe" + "[wsl2]\r\nmemory=24GB\r\n".encode("utf-16-le")


def test_new_file_and_file_without_final_newline():
    assert merge(None, WSLCONF, "boot", {"systemd": "true"}).data == b"[boot]\nsystemd=true\n"
    assert merge(b"[boot]\nx=1", WSLCONF, "boot", {"systemd": "true"}).data == b"[boot]\nx=1\nsystemd=true\n"


def test_a_value_that_needs_quoting_is_written_so_wsl_reads_it_back():
    result = merge(b"", WSLCONFIG, "wsl2", {"kernelCommandLine": "a # b"})
    assert parse(result.data, WSLCONFIG).value("wsl2", "kernelCommandLine") == "a # b"


def test_wsl_conf_that_stops_before_the_place_is_a_finding_and_nothing_is_written():
    data = b"[network]\nhostname=ws1\n; a comment WSL does not know\n[boot]\nsystemd=false\n"
    result = merge(data, WSLCONF, "boot", {"systemd": "true"})
    assert result.data == data and not result.writes
    assert result.problem is not None and result.problem.line == 3
    assert "stops reading" in result.problem.message


def test_undecodable_wslconfig_is_a_finding():
    result = merge("[wsl2]\r\nmemory=4GB\r\n".encode("utf-16-le"), WSLCONFIG, "wsl2", {"memory": "24GB"})
    assert result.problem is not None and not result.writes


def test_a_continued_value_is_not_edited():
    data = b"[wsl2]\nmemory=16\\\nGB\n"
    result = merge(data, WSLCONFIG, "wsl2", {"memory": "24GB"})
    assert result.problem is not None and result.problem.line == 2 and result.data == data


def test_merge_is_idempotent():
    data = b"x=1\n[experimental]\nnetworkingMode=nat\n[wsl2]\nmemory=1GB # c\n"
    want = dict(WANT, networkingMode="mirrored")
    once = merge(data, WSLCONFIG, "wsl2", want).data
    assert merge(once, WSLCONFIG, "wsl2", want).data == once
