"""Read a gradio_client job's streamed outputs as they arrive.

gradio_client 2.7's `for output in job` holds the job's lock while it sleeps between checks, and the
thread that receives the server's messages needs that lock to store each one: on a many-core machine
it can wait for seconds, and a whole reply then arrives at once at the end (0.9-8 s for one user on the
H200 box, a reply the server had finished in 0.8 s; a 40-message imitation of the pattern on a 2-core
machine held messages up to 2.3 s). Polling `job.outputs()`, which takes the lock only to copy the
list, and sleeping outside it, sees each output within `poll_s`.
"""

import time


def streamed_outputs(job, poll_s: float = 0.005):
    """Yield each of `job`'s outputs once, in order, as they arrive; ends when the job is done."""
    seen = 0
    while True:
        done = job.done()  # read before the outputs: a done job has stored all of them
        outputs = job.outputs()
        yield from outputs[seen:]
        seen = len(outputs)
        if done:
            return
        time.sleep(poll_s)
