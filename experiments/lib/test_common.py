"""Tests of the shared readers and the verdict helpers."""
import os
import tempfile
import unittest

from common import (deaths, load_json, orders_account_for_keys, read_csv, recon_word, service_deaths,
                    verdict, write_csv, write_json)
from fixtures import loadgen


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

    def test_ambiguous_keys_hold_zero_or_one_order(self):
        # 990 keys succeeded; 10 were ambiguous (a timeout, a 408, a 503 after
        # the commit), 4 of which committed.
        load = loadgen(keys_succeeded=990, ambiguous=10)
        exact = {"ambiguous_committed": 4}
        self.assertEqual(orders_account_for_keys(994, load, exact),
                         (True, "keys that succeeded 990 + ambiguous committed 4"))
        self.assertFalse(orders_account_for_keys(990, load, exact)[0])
        self.assertFalse(orders_account_for_keys(995, load, exact)[0])
        self.assertFalse(orders_account_for_keys(None, load, exact)[0])
        # Without recon's count: anything from 0 to all of the ambiguous keys.
        for orders, holds in ((989, False), (990, True), (994, True), (1000, True), (1001, False)):
            self.assertEqual(orders_account_for_keys(orders, load, {})[0], holds, orders)
        self.assertEqual(orders_account_for_keys(1000, load, None)[1],
                         "between keys that succeeded 990 and that + ambiguous 10")

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
