"""What each command does (scan, replay, bisect, run, init, repro bundles); commands return a
Report and never print or exit."""
