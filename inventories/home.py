"""This workstation: pyinfra runs inside the WSL2 distro itself (@local).

    pyinfra inventories/home.py deploys/freetoken.py

@local carries no hardware class: the launch plan follows whatever GPU nvidia-smi reports, so the
main command works on any supported card. A class is the owner's choice: move @local into the
group of your card (`rtx5060ti_16gb = ["@local"]`, see group_data/) to get that class's settings,
such as the health gate's decode floor; the preflight then checks that the GPU is that class's.
"""

home = ["@local"]
