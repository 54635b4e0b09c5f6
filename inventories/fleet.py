"""An example fleet: several Windows workstations, each running the deploy inside its WSL2
distro, reached over SSH and grouped by hardware class (each group name is a
group_data/<class>.py file, whose values apply to its hosts). Copy this file, put in your
machines' addresses (these are documentation addresses, RFC 5737) and run

    pyinfra -y inventories/fleet.py deploys/doctor.py          # read-only preflight
    python -m freetoken_infra.rollout inventories/fleet.py     # canary, batches, fleet report

Making a WSL distro reachable over SSH, once per workstation (the deploy cannot do this part:
it needs the connection first):

1. Mirrored networking, so the distro answers on the workstation's own LAN address: in
   %UserProfile%\\.wslconfig under [wsl2] add `networkingMode=mirrored` (WSL 2.0 or later on
   Windows 11 22H2 or later), then `wsl.exe --shutdown` from Windows. The deploy keeps it
   there: `wslconfig_networking_mode = "mirrored"` below.
2. Let the distro receive connections through the Hyper-V firewall, from the controller only
   and on home or work networks only, in an administrator PowerShell (the id is WSL's, the
   same on every machine; 192.0.2.5: your controller's address):
       New-NetFirewallHyperVRule -DisplayName "WSL sshd" -Direction Inbound
           -VMCreatorId "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}" -Protocol TCP -LocalPorts 2222
           -RemoteAddresses 192.0.2.5 -Profiles Domain,Private
3. sshd in the distro, on a port Windows' own OpenSSH server does not use (2222 here), in a
   drop-in named to be read first (sshd keeps the first value it reads):
       sudo apt-get install -y openssh-server
       printf 'Port 2222\\nPasswordAuthentication no\\nAllowUsers deploy\\n' |
           sudo tee /etc/ssh/sshd_config.d/00-freetoken.conf
       sudo systemctl enable --now ssh
   (needs systemd in the distro: `[boot] systemd=true` in /etc/wsl.conf, then
   `wsl.exe --shutdown`; the deploy sets that too, but sshd has to come first.)
4. Key authentication for the user the deploy logs in as (an account of its own, not yours):
   append your controller's public key, as `from="192.0.2.5" ssh-ed25519 ...`, to that user's
   ~/.ssh/authorized_keys in the distro (mode 600, ~/.ssh mode 700).
5. sudo without a password prompt for that user, as root (the deploy elevates with sudo when
   it does not log in as root; a prompt cannot be answered in a batch run):
       echo "deploy ALL=(root) NOPASSWD: ALL" | sudo tee /etc/sudoers.d/freetoken-deploy
       sudo chmod 440 /etc/sudoers.d/freetoken-deploy
6. Keep the distro running with nobody logged in: `windows_autostart = True` (a scheduled
   task at logon) or your own task; `vmIdleTimeout=0` is already in group_data/all.py.

Then check from the controller: `ssh -p 2222 deploy@192.0.2.11 true`.
"""

# Fleet-wide: how pyinfra connects, and the networking mode the deploy keeps in .wslconfig.
# (Any setting of group_data/all.py can go here, or on one host as (name, {...}) data.)
_SSH = {
    "ssh_user": "deploy",
    "ssh_port": 2222,
    "wslconfig_networking_mode": "mirrored",
}

# RTX 5060 Ti 16 GB: the field report's card (group_data/rtx5060ti_16gb.py).
rtx5060ti_16gb = [
    ("lab-ws01", {"ssh_hostname": "192.0.2.11", **_SSH}),
    ("lab-ws02", {"ssh_hostname": "192.0.2.12", **_SSH}),
    ("lab-ws03", {"ssh_hostname": "192.0.2.13", **_SSH}),
]

# RTX 5090 32 GB (group_data/rtx5090_32gb.py): the derived launch plan doubles the caches.
rtx5090_32gb = [
    ("lab-ws10", {"ssh_hostname": "192.0.2.20", **_SSH}),
    # A host's own setting: this one starts its distro at logon (a scheduled task).
    ("lab-ws11", {"ssh_hostname": "192.0.2.21", **_SSH, "windows_autostart": True}),
]
