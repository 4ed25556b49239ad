"""A short job for tests/distributed/test_security.py: sets up the communication of one
launcher (argv[1]: horovod, mpi, multiworker or mirrored), runs one collective, writes
`ready-<rank>` in the directory argv[2], then waits (at most 60 s) for `stop` there."""

import json
import os
import sys
import time

mode, where = sys.argv[1], sys.argv[2]
if mode == "horovod":
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(tf.constant(1.0))
elif mode == "mpi":
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    MPI.COMM_WORLD.allreduce(1)
elif mode == "multiworker":
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
else:  # mirrored: one process, two logical CPU devices
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rank = 0
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
open(os.path.join(where, f"ready-{rank}"), "w").close()
end = time.monotonic() + 60
while not os.path.exists(os.path.join(where, "stop")) and time.monotonic() < end:
    time.sleep(0.1)
if mode == "multiworker":
    from dist_minimize import cluster

    cluster.exit_worker(0)
