"""twofour inside other training engines: :mod:`twofour.integrations.torchtitan` (an optional extra).

Each integration imports its engine on import and says in one line how to install it when missing;
``import twofour`` never imports them.
"""
