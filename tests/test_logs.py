import json
import logging

from nbwatch.logs import open_run_log


def test_run_log_is_one_json_object_per_line_with_extras(tmp_path):
    logger = logging.getLogger("nbwatch.run.test-logs")
    handler = open_run_log(logger, tmp_path)
    try:
        logger.info("step", extra={"step": 7, "data": {"loss/train": 2.5}})
        logger.critical("nonfinite: <b>x</b>", extra={"step": 8, "kind": "alert"})
    finally:
        logger.removeHandler(handler)
        handler.close()
    lines = [json.loads(ln) for ln in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [ln["level"] for ln in lines] == ["info", "critical"]
    assert lines[0]["step"] == 7 and lines[0]["data"] == {"loss/train": 2.5}
    assert lines[1]["message"] == "nonfinite: <b>x</b>" and lines[1]["kind"] == "alert"
