"""Errors a user can fix; the CLI prints them in one line and exits with their `exit_code`."""


class UserError(ValueError):
  """A mistake in the config or the data that the message explains."""

  exit_code = 2


class ConfigError(UserError):
  """A config value a user can fix; the message names the key."""


class DataError(UserError):
  """A dataset problem a user can fix: not prepared, wrong split, corrupt record, no files."""


class StorageError(UserError):
  """The workdir cannot hold the run: not writable, or too little free space for checkpoints."""


class NonFiniteError(UserError):
  """Training produced a non-finite loss or gradient; the message names device, stage, step."""

  exit_code = 3


class RejoinError(UserError):
  """A process started again into its running run could not rejoin it (the message says why;
  the others train on)."""

  exit_code = 4
