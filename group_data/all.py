"""Choices for every host of the inventory that differ from the defaults.

The defaults (the field report's working deployment) and what each setting means live in
one place, freetoken_infra/core/settings.py, and in the README's settings table made from it.
Put here only a deliberate choice for all your hosts, e.g.

    listen_host = "0.0.0.0"          # serve the LAN, not just this PC
    model_cache_host = "lab-ws01"    # the model crosses the internet once per fleet

A hardware class overrides this file (group_data/<class>.py), a host's inventory data
overrides both. Every key is validated before any host is touched; an unknown key or a bad
value stops the run.
"""
