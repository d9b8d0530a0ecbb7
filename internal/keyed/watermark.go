package keyed

import "sort"

// watermark tracks the unfinished offsets of one partition, in submit
// order (offsets only grow within a partition; gaps, such as Kafka's
// transaction markers, are allowed). It keeps only the unfinished ones,
// so its memory is bounded by MaxInFlight even while one old message
// holds the watermark and the partition runs far ahead of it.
type watermark struct {
	unfinished []int64 // ascending
	last       int64   // the highest offset submitted
	known      bool    // whether anything was submitted
}

// add records a submitted offset; it reports false for an offset not
// above the last one (a stream that went backwards).
func (w *watermark) add(offset int64) bool {
	if w.known && offset <= w.last {
		return false
	}
	w.last, w.known = offset, true
	w.unfinished = append(w.unfinished, offset)
	return true
}

// done marks offset finished and reports whether the watermark advanced
// (the oldest unfinished message finished).
func (w *watermark) done(offset int64) bool {
	i := sort.Search(len(w.unfinished), func(i int) bool { return w.unfinished[i] >= offset })
	if i == len(w.unfinished) || w.unfinished[i] != offset {
		return false
	}
	w.unfinished = append(w.unfinished[:i], w.unfinished[i+1:]...)
	return i == 0
}

// value returns the watermark, the lowest unfinished offset (or the one
// after the last submitted, when none is unfinished), and whether
// anything was submitted.
func (w *watermark) value() (int64, bool) {
	if len(w.unfinished) > 0 {
		return w.unfinished[0], w.known
	}
	return w.last + 1, w.known
}
