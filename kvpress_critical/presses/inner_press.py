"""What both critical presses share as wrappers of a base press."""

from kvpress_critical.presses.checks import check_ratio


class InnerPressMixin:
    """
    Delegates ``compression_ratio`` and ``post_init_from_model`` to the wrapped base press ``self.press``.

    kvpress's wrappers (``AdaKVPress``, ``DecodingPress``, ``PerLayerCompressionPress``...) read and set
    ``compression_ratio`` on the press they hold; the value lives in the base press, and is checked here.
    """

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        check_ratio(value)
        self.press.compression_ratio = value

    def post_init_from_model(self, model):
        self.press.post_init_from_model(model)
