def test_delegate_runs_and_records(kg):
    assert kg.delegate("one", 0.1).startswith("started one (#1), slot 1/3")
    t = kg.wait_state("one", "succeeded")
    assert t["exit_code"] == 0
    assert set(kg.times("one")) == {"start", "end"}
