"""The one report data model and every way to show it (console, JSON, JUnit, Markdown, GitHub,
plot), written atomically."""
