"""What a process shows of its memory, and `gpumem top`, which reads it from outside.

    startup    starts what the environment asks for when gpumem is installed: the one place
    figures    every figure users see about a device, defined once
    metrics    Prometheus metrics (gpumem.serve_metrics), over http_server
    pressure   alerts at a share of the cap (gpumem.on_pressure, GPUMEM_WARN_AT)
    timeline   a recorder of allocated and reserved over time (gpumem.timeline)
    reporting  the report of a device's memory (gpumem.report)
    publish    each process's figures in a file for `gpumem top`; published reads them back
    top        `gpumem top`, with nvml (the driver's view) and proc (/proc's)
"""
