"""The cheap path: build the session, then step under sentinels until the first non-finite value."""
