"""Errors a user can fix; the CLI prints them in one line and exits with status 2."""


class UserError(ValueError):
  """A mistake in the config or the data that the message explains."""


class ConfigError(UserError):
  """A config value a user can fix; the message names the key."""


class DataError(UserError):
  """A dataset problem a user can fix: not prepared, wrong split, corrupt record, no files."""
