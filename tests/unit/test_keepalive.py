"""When a keepalive PING goes (engine/keepalive.py): pure rules, with grpc-core's ping policy as the reference."""

from orchestrator.transport.keepalive import FREE_PINGS, SERVER_MIN_PING_INTERVAL_S, KeepalivePolicy


def test_a_ping_goes_only_after_the_interval_without_hearing_anything():
    policy = KeepalivePolicy(interval_s=30, timeout_s=10)
    assert policy.ping_due(quiet_since=100.0, last_ping=0.0, pings_since_data=0) == 130.0
    assert policy.ping_due(quiet_since=125.0, last_ping=0.0, pings_since_data=0) == 155.0  # something arrived


def test_without_data_from_the_server_pings_beyond_the_free_ones_keep_to_its_minimum_interval():
    """grpc-core: a ping sooner than 5 min after the last one is a strike unless the server sent HEADERS or DATA
    since; the first is free, 2 strikes are allowed. Two go at the interval, then one per 5 minutes."""
    policy = KeepalivePolicy(interval_s=30, timeout_s=10)
    assert FREE_PINGS == 2
    assert policy.ping_due(quiet_since=130.0, last_ping=130.0, pings_since_data=1) == 160.0
    assert policy.ping_due(quiet_since=160.0, last_ping=160.0, pings_since_data=2) == 160.0 + SERVER_MIN_PING_INTERVAL_S
    long = KeepalivePolicy(interval_s=600, timeout_s=10)  # longer than the server's minimum: the interval rules
    assert long.ping_due(quiet_since=0.0, last_ping=0.0, pings_since_data=5) == 600.0


def test_too_many_pings_doubles_both_intervals_and_is_news_only_the_first_time():
    policy = KeepalivePolicy(interval_s=30, timeout_s=10)
    assert policy.too_many_pings() is True
    assert (policy.interval_s, policy.quiet_interval_s) == (60, 2 * SERVER_MIN_PING_INTERVAL_S)
    assert policy.too_many_pings() is False
    assert (policy.interval_s, policy.quiet_interval_s, policy.timeout_s) == (120, 4 * SERVER_MIN_PING_INTERVAL_S, 10)
