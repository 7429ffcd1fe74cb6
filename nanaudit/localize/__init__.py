"""The expensive path: replay the bad step under instruments, name the op, its cause and the
offending rows."""
