"""The user's commands, one module each (`python -m mlxdist.X` runs `mlxdist/commands/X.py`
through the root module of that name). They sit on top: no library package imports them.
`export_task` is the export command's half for a Task (generate uses it too)."""
