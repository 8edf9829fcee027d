"""`tandem run` / `python -m tandem.launch`: a whole deployment on one machine from one command.

spec.py (what to run, from flags or YAML) -> plan.py (command lines, environments, cores, ports) ->
supervisor.py (the processes: logs, restarts, stop) <- main.py (the CLI, readiness, signals).
"""
