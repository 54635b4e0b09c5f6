"""freetoken_infra/enrolment.py (`fleet add` / `remove`): the inventory edit keeps every other
byte, a taken or unknown name is refused, and the SSH login pins the host key the PC printed
(a paramiko SSH server on loopback stands in for the PC's sshd)."""

import re
import socket
import threading
from pathlib import Path

import paramiko
import pytest

from freetoken_infra import enrolment
from freetoken_infra.enrolment import EnrolError

FLEET = Path(__file__).resolve().parents[2] / "inventories" / "fleet.py"
PIN = "SHA256:" + "A" * 43


def host(name="lab-ws12", group="rtx5090_32gb", **kw):
    args = {"port": 2222, "user": "deploy", "host_key": PIN, "group": group, **kw}
    return enrolment.new_host(name, "192.0.2.22", **args)


def test_add_inserts_one_line_into_the_class_list_and_nothing_else():
    source = FLEET.read_text()
    edited = enrolment.with_host(source, host())
    old, new = source.splitlines(), edited.splitlines()
    assert len(new) == len(old) + 1
    added = [line for line in new if line not in old]
    assert len(added) == 1 and added[0].startswith('    ("lab-ws12", {"ssh_hostname": "192.0.2.22"')
    assert [line for line in new if line != added[0]] == old  # every other line as it was, in order
    assert enrolment.hosts_in(edited)["lab-ws12"] == "rtx5090_32gb"
    compile(edited, "fleet.py", "exec")


def test_a_new_class_becomes_a_new_list_at_the_end():
    edited = enrolment.with_host(FLEET.read_text(), host(group="rtx4090_24gb"))
    assert edited.endswith(
        'rtx4090_24gb = [\n    ("lab-ws12", ' + edited.split('rtx4090_24gb = [\n    ("lab-ws12", ')[1]
    )
    assert enrolment.hosts_in(edited)["lab-ws12"] == "rtx4090_24gb"


def test_a_last_element_without_its_comma_gets_one():
    source = 'hosts = [\n    ("a", {}),\n    ("b", {})  # mine\n]\n'
    edited = enrolment.with_host(source, host(group="hosts"))
    assert '    ("b", {}),  # mine\n' in edited and enrolment.hosts_in(edited) == {
        "a": "hosts",
        "b": "hosts",
        "lab-ws12": "hosts",
    }


def test_a_taken_name_or_a_one_line_list_is_refused():
    with pytest.raises(EnrolError, match="lab-ws01: already in the inventory"):
        enrolment.with_host(FLEET.read_text(), host(name="lab-ws01"))
    with pytest.raises(EnrolError, match="one host per line"):
        enrolment.with_host('hosts = [("a", {})]\n', host(group="hosts"))


def test_remove_takes_out_exactly_the_lines_add_put_in():
    source = FLEET.read_text()
    assert enrolment.without_host(enrolment.with_host(source, host()), "lab-ws12") == source
    without = enrolment.without_host(source, "lab-ws11")
    assert "lab-ws11" not in enrolment.hosts_in(without) and set(enrolment.hosts_in(without)) == set(
        enrolment.hosts_in(source)
    ) - {"lab-ws11"}
    with pytest.raises(EnrolError, match="lab-ws99: not in the inventory"):
        enrolment.without_host(source, "lab-ws99")


@pytest.mark.parametrize(
    "change, says",
    [
        ({"host_key": None}, "--host-key: give the fingerprint"),
        ({"host_key": "MD5:aa:bb"}, "--host-key 'MD5:aa:bb'"),
        ({"user": "root;reboot"}, "--user"),
        ({"group": "Bad-Group"}, "--class"),
        ({"port": 0}, "--port 0"),
    ],
)
def test_bad_input_is_refused_naming_the_field(change, says):
    with pytest.raises(EnrolError, match=says):
        host(**change)


@pytest.mark.parametrize("address", ["192.0.2.1; reboot", "$(id)", "a..b", "-oProxyCommand=x"])
def test_an_address_that_is_neither_ip_nor_name_is_refused(address):
    with pytest.raises(EnrolError, match="ADDRESS"):
        enrolment.new_host("ws9", address, port=2222, user="root", host_key=PIN, group=None)


# --------------------------------------------------------------------------- SSH, pinned
class _Server(paramiko.ServerInterface):
    def __init__(self, client_key):
        self.client_key = client_key

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL if key.asbytes() == self.client_key.asbytes() else paramiko.AUTH_FAILED

    def get_allowed_auths(self, username):
        return "publickey"

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        channel.send_exit_status(0 if command == b"true" else 1)
        return True


@pytest.fixture
def pc(tmp_path):
    """An SSH server on loopback with its own host key, accepting the controller's key."""
    host_key = paramiko.RSAKey.generate(2048)
    client_key = paramiko.RSAKey.generate(2048)
    client_file = tmp_path / "id_rsa"
    client_key.write_private_key_file(str(client_file))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(20)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(host_key)
            try:
                transport.start_server(server=_Server(client_key))
            except (paramiko.SSHException, OSError):  # a client that refused our key and left
                continue
            channel = transport.accept(10)
            if channel is not None:
                threading.Event().wait(0.5)
                channel.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield {
        "port": listener.getsockname()[1],
        "fingerprint": enrolment.key_fingerprint(host_key.asbytes()),
        "ssh_key": str(client_file),
        "known_hosts": str(tmp_path / "known_hosts"),
    }
    stop.set()
    listener.close()


def _pc_host(pc, **kw):
    args = {"port": pc["port"], "user": "root", "host_key": pc["fingerprint"], "group": None, **kw}
    args.setdefault("ssh_key", pc["ssh_key"])
    args.setdefault("known_hosts", pc["known_hosts"])
    h = enrolment.new_host("ws9", "127.0.0.1", **args)
    return h


def test_the_printed_host_key_is_pinned_and_recorded_for_pyinfra(pc):
    enrolment.check_reachable(_pc_host(pc))
    known = paramiko.HostKeys(pc["known_hosts"])
    entry = known.lookup(f"[127.0.0.1]:{pc['port']}")
    assert entry is not None and enrolment.key_fingerprint(next(iter(entry.values())).asbytes()) == pc["fingerprint"]


def test_another_host_key_is_refused_before_any_login_and_nothing_is_recorded(pc):
    with pytest.raises(EnrolError, match=re.escape(f"offers host key {pc['fingerprint']}, not the pinned {PIN}")):
        enrolment.check_reachable(_pc_host(pc, host_key=PIN))
    assert not Path(pc["known_hosts"]).exists()


def test_add_without_the_doctor_writes_the_inventory_and_pins_the_key(pc, tmp_path):
    inventory = tmp_path / "fleet.py"
    inventory.write_text(FLEET.read_text())
    enrolment.add(str(inventory), _pc_host(pc), doctor=False, say=lambda m: None)
    data = dict(eval(line.strip().rstrip(","), {}) for line in inventory.read_text().splitlines() if '"ws9"' in line)[
        "ws9"
    ]
    assert data["ssh_port"] == pc["port"] and data["ssh_strict_host_key_checking"] == "yes"
    assert data["ssh_known_hosts_file"] == pc["known_hosts"]


def test_add_of_a_wrong_key_leaves_the_inventory_as_it_was(pc, tmp_path):
    inventory = tmp_path / "fleet.py"
    inventory.write_text(FLEET.read_text())
    with pytest.raises(EnrolError):
        enrolment.add(str(inventory), _pc_host(pc, host_key=PIN), doctor=False, say=lambda m: None)
    assert inventory.read_text() == FLEET.read_text()


def test_remove_drains_first_and_a_failed_drain_changes_nothing(tmp_path):
    inventory = tmp_path / "fleet.py"
    inventory.write_text(FLEET.read_text())
    order = []

    def drain(name):
        order.append(("drain", name, "lab-ws02" in inventory.read_text()))
        return []

    enrolment.remove(str(inventory), "lab-ws02", drain=drain, say=lambda m: None)
    assert order == [("drain", "lab-ws02", True)] and "lab-ws02" not in inventory.read_text()

    def refuse(name):
        raise enrolment.EnrolError("gateway unreachable")

    before = inventory.read_text()
    with pytest.raises(EnrolError, match="gateway unreachable"):
        enrolment.remove(str(inventory), "lab-ws03", drain=refuse, say=lambda m: None)
    assert inventory.read_text() == before


def test_add_logs_in_as_the_account_enrol_made_unless_told(monkeypatch, tmp_path):
    """enrol.py's default deploy account is `fleet add`'s default user (one name, two files)."""
    import sys

    from freetoken_infra import fleet

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "operations" / "scripts"))
    import enrol

    assert enrolment.DEPLOY_USER == enrol.DEPLOY_USER == "freetoken-deploy"
    added = []
    monkeypatch.setattr(enrolment, "add", lambda inventory, host, doctor: added.append(host))
    inventory = str(tmp_path / "fleet.py")
    assert fleet.main(["-i", inventory, "add", "ws7", "192.0.2.17", "--host-key", PIN]) == 0
    assert fleet.main(["-i", inventory, "add", "ws8", "192.0.2.18", "--host-key", PIN, "--user", "alice"]) == 0
    assert [h.user for h in added] == ["freetoken-deploy", "alice"]
