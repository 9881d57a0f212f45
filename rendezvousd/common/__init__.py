"""What the daemon, the client SDK and the trainer share: settings, addresses, escaping, the values crossing the state machine's boundary, field checks and bounds.

Nothing here imports the daemon's server, state machine or storage, so the SDK and
the trainer can import it without them.
"""
