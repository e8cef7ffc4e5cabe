"""The head node of the scenarios' multi-node `ray.cluster_utils.Cluster`s.

A node the cloud takes (`Cluster.remove_node(node, allow_graceful=False)`: its raylet is killed) is
declared dead by the GCS's health checks. With Ray's defaults (a check every 3 s, a 10 s timeout,
5 misses) that took about 30 s, and in that time Ray Train still counted the node's CPU and tried
the larger group again and again (test_elastic: five tries of `failure.group_start_timeout_s`, 5 s
each, before the group shrank). Checked every second with a 2 s timeout, 3 misses in a row, the
node is dead within about 5 s, as a cluster that hears of a terminated instance at once would say.
"""

HEAD_NODE_ARGS = {
    "num_cpus": 1,
    "_system_config": {
        "health_check_period_ms": 1000,
        "health_check_timeout_ms": 2000,
        "health_check_failure_threshold": 3,
    },
}
