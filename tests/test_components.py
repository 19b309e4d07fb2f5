"""Connected groups: the union-find shared by fusion pricing and the ILP's blocks."""
from tapestry.components import connected_groups


def test_linked_items_form_groups_in_item_order_whatever_the_links_direction():
    items = ["a", "b", "c", "d", "e"]
    assert connected_groups(items, [("d", "b"), ("e", "a")]) == [["a", "e"], ["b", "d"], ["c"]]
    assert connected_groups(items, [("b", "d"), ("a", "e"), ("e", "d")]) == [["a", "b", "d", "e"], ["c"]]


def test_no_links_leave_each_item_alone():
    assert connected_groups([3, 1, 2], []) == [[3], [1], [2]]
