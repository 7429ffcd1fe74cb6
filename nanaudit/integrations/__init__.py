"""Integrations with training frameworks. Each lives in its own module and imports its
framework only when used: `import nanaudit.integrations` imports none of them."""
