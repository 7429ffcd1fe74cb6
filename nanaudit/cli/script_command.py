"""The click command of `nanaudit run`: nanaudit's options, then the script and its arguments.

`run` passes everything from the script on to the script unparsed, so click must not read the
script's own options as nanaudit's. Before the script, though, every token that starts with
`-` must be one of nanaudit's options: an unknown one (`--jsn out.json train.py`) is a usage
error naming the closest option, as every other command gives, never taken for the script.
The script starts at the first token that is not an option (or at `-m MODULE`); a script
whose name starts with `-` is given after `--`.
"""

from __future__ import annotations

import click

MODULE_FLAG = "-m"       # `nanaudit run -m pkg.train`: the module form, as `python -m`


class ScriptCommand(click.Command):
    """A command whose trailing arguments belong to a script (see the module docstring)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        self._refuse_unknown_options(ctx, args)
        return super().parse_args(ctx, args)

    def _refuse_unknown_options(self, ctx: click.Context, args: list[str]) -> None:
        takes_value = self._options_taking_values(ctx)
        known = set(takes_value) | self._flags(ctx)
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--" or token == MODULE_FLAG or not token.startswith("-") \
                    or token == "-":
                return            # the script starts here (after `--`, whatever its name)
            name = token.split("=", 1)[0] if token.startswith("--") else token
            if name not in known:
                raise click.NoSuchOption(name, possibilities=sorted(known), ctx=ctx)
            i += 1 + (takes_value.get(name, 0) if "=" not in token else 0)

    def _options_taking_values(self, ctx: click.Context) -> dict[str, int]:
        """Each option name that takes values -> how many tokens they are."""
        return {name: option.nargs for option in self._options(ctx)
                if not option.is_flag and not option.count
                for name in (*option.opts, *option.secondary_opts)}

    def _flags(self, ctx: click.Context) -> set[str]:
        flags = {name for option in self._options(ctx) if option.is_flag or option.count
                 for name in (*option.opts, *option.secondary_opts)}
        return flags | set(self.get_help_option_names(ctx))

    def _options(self, ctx: click.Context) -> list[click.Option]:
        return [p for p in self.get_params(ctx) if isinstance(p, click.Option)]
