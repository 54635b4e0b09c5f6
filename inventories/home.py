"""This workstation: pyinfra runs inside the WSL2 distro itself (@local).

    pyinfra inventories/home.py deploys/freetoken.py

@local sits in the field report's hardware class (RTX 5060 Ti 16 GB); move it to
the group of your card (see group_data/), or list it as `home = ["@local"]` with
no class, and the launch plan follows whatever GPU nvidia-smi reports.
"""

rtx5060ti_16gb = ["@local"]
