"""What a compressed checkpoint says about itself: report.json / report.md (reports), the model card (card),
and the plots (plots). Takes result objects and metadata; never a loaded model."""
