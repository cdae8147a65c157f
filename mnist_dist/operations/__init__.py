"""What a run needs around its training: checkpoints and resume, run directories, preemption, errors and
the console, machine facts, downloads, and what a run writes at its end."""
