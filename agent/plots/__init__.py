"""Pictures for people: run plots (``sustain probe --plot``, ``sustain analyze --plot``, ``sustain
report run``) and the planner's HTML report (``sustain report fleet``).

Only the CLI imports this room, and only in those commands: matplotlib (the optional extra
``sustain[report]``) is loaded by ``agent.plots.canvas`` when a picture is drawn, and contract
``daemon-stays-small`` keeps the daemon's rooms from reaching it.
"""
