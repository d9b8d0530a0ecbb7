package keyed

import "sort"

// watermark tracks the offsets of one partition between Submit and their
// end, in submit order (offsets only grow within a partition; gaps, such
// as Kafka's transaction markers, are allowed).
type watermark struct {
	pending []entry // not yet passed by the watermark, ascending offsets
	next    int64   // the watermark: every offset below it is finished
	known   bool    // whether next means anything (anything was submitted)
}

type entry struct {
	offset int64
	done   bool
}

// add records a submitted offset; it reports false for an offset not
// above the last one (a stream that went backwards).
func (w *watermark) add(offset int64) bool {
	if n := len(w.pending); n > 0 && offset <= w.pending[n-1].offset {
		return false
	}
	if w.known && len(w.pending) == 0 && offset < w.next {
		return false
	}
	if !w.known {
		w.next, w.known = offset, true
	}
	w.pending = append(w.pending, entry{offset: offset})
	return true
}

// done marks offset finished and reports whether the watermark advanced.
func (w *watermark) done(offset int64) bool {
	i := sort.Search(len(w.pending), func(i int) bool { return w.pending[i].offset >= offset })
	if i == len(w.pending) || w.pending[i].offset != offset {
		return false
	}
	w.pending[i].done = true
	n := 0
	for n < len(w.pending) && w.pending[n].done {
		n++
	}
	if n == 0 {
		return false
	}
	w.next = w.pending[n-1].offset + 1
	if len(w.pending) > n {
		w.next = w.pending[n].offset
	}
	// Shift rather than reslice so the array does not grow without bound.
	w.pending = w.pending[:copy(w.pending, w.pending[n:])]
	return true
}

// value returns the watermark and whether anything was submitted.
func (w *watermark) value() (int64, bool) { return w.next, w.known }
