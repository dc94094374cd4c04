"""Tests of the shared readers and the verdict helpers."""
import os
import tempfile
import unittest

from common import (deaths, load_json, read_csv, recon_word, service_deaths, verdict, write_csv,
                    write_json)


class CommonTest(unittest.TestCase):
    def test_deaths_are_summed_over_services(self):
        c = {"services": {"relay": {"deaths": {"crash_point:publish": 3, "random_kill": 1}},
                          "orders": {"deaths": {"random_kill": 2}}, "payments": {"deaths": {}}}}
        self.assertEqual(deaths(c), {"crash_point:publish": 3, "random_kill": 3})
        self.assertEqual(service_deaths(c, "relay", "crash_point:publish"), 3)
        self.assertEqual(service_deaths(c, "payments", "crash_point:effect"), 0)
        self.assertEqual(service_deaths(c, "nobody", "x"), 0)

    def test_verdict_needs_every_check_and_at_least_one(self):
        self.assertEqual(verdict({"a": True, "b": True}), "PASS")
        self.assertEqual(verdict({"a": True, "b": False}), "FAIL")
        self.assertEqual(verdict({}), "FAIL")

    def test_recon_word(self):
        self.assertEqual([recon_word(i) for i in (0, 1, 2, -1)], ["CLEAN", "DRIFT", "ERROR", "ERROR"])

    def test_json_and_csv_round_trip_and_missing_files(self):
        with tempfile.TemporaryDirectory() as d:
            write_json(os.path.join(d, "a.json"), {"x": [1, 2]})
            self.assertEqual(load_json(os.path.join(d, "a.json")), {"x": [1, 2]})
            self.assertIsNone(load_json(os.path.join(d, "missing.json")))
            with open(os.path.join(d, "bad.json"), "w", encoding="utf-8") as f:
                f.write("{cut")
            self.assertEqual(load_json(os.path.join(d, "bad.json"), {}), {})
            write_csv(os.path.join(d, "t.csv"), [{"a": 1, "b": 2}, {"a": 3, "c": 4}])
            self.assertEqual(read_csv(os.path.join(d, "t.csv")),
                             [{"a": "1", "b": "2", "c": ""}, {"a": "3", "b": "", "c": "4"}])
            write_csv(os.path.join(d, "none.csv"), [])
            self.assertFalse(os.path.exists(os.path.join(d, "none.csv")))


if __name__ == "__main__":
    unittest.main()
