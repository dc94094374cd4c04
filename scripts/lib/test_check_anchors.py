"""check_anchors.py against a two-page book made here."""

import pathlib
import tempfile
import unittest

import check_anchors


def book(pages):
    root = pathlib.Path(tempfile.mkdtemp())
    for name, text in pages.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


class CheckAnchors(unittest.TestCase):
    def test_a_link_to_a_heading_that_is_there_passes(self):
        root = book({
            "a.html": '<h2 id="faults">Faults</h2><a href="b.html#network-faults">x</a><a href="#faults">y</a>',
            "b.html": '<h2 id="network-faults">Network faults</h2>',
        })
        self.assertEqual(check_anchors.main(root), 0)

    def test_a_link_to_a_heading_that_is_gone_fails(self):
        root = book({
            "a.html": '<a href="b.html#renamed">x</a>',
            "b.html": '<h2 id="network-faults">Network faults</h2>',
        })
        self.assertEqual(check_anchors.main(root), 1)

    def test_a_missing_anchor_on_the_same_page_fails(self):
        self.assertEqual(check_anchors.main(book({"a.html": '<a href="#nowhere">x</a>'})), 1)

    def test_links_out_of_the_book_are_left_to_the_link_checker(self):
        root = book({"a.html": '<a href="../../../FINDINGS.md#x">x</a><a href="https://example.com/#y">y</a>'})
        self.assertEqual(check_anchors.main(root), 0)


if __name__ == "__main__":
    unittest.main()
