def report(config, metrics, tables):
    return "## What the numbers show\n\nstub\n", {}
