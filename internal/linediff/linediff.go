// Package linediff is the line diff of two texts (longest common
// subsequence), for the audit row of an edited replay and the console's
// edit preview (through dlq.LineDiff: the console imports no internal
// package).
package linediff

import "strings"

// Line is one line of a diff: Op is ' ' (kept), '-' (removed) or '+'
// (added).
type Line struct {
	Op   byte
	Text string
}

// maxCells bounds the LCS table: beyond it, every old line is removed and
// every new one added (still a correct diff, not a minimal one).
const maxCells = 4_000_000

// Diff returns the line diff of a and b.
func Diff(a, b string) []Line {
	x, y := strings.Split(a, "\n"), strings.Split(b, "\n")
	n, m := len(x), len(y)
	if n*m > maxCells {
		out := make([]Line, 0, n+m)
		for _, l := range x {
			out = append(out, Line{'-', l})
		}
		for _, l := range y {
			out = append(out, Line{'+', l})
		}
		return out
	}
	lcs := make([][]int32, n+1)
	for i := range lcs {
		lcs[i] = make([]int32, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if x[i] == y[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var out []Line
	i, j := 0, 0
	for i < n && j < m {
		switch {
		case x[i] == y[j]:
			out = append(out, Line{' ', x[i]})
			i, j = i+1, j+1
		case lcs[i+1][j] >= lcs[i][j+1]:
			out = append(out, Line{'-', x[i]})
			i++
		default:
			out = append(out, Line{'+', y[j]})
			j++
		}
	}
	for ; i < n; i++ {
		out = append(out, Line{'-', x[i]})
	}
	for ; j < m; j++ {
		out = append(out, Line{'+', y[j]})
	}
	return out
}

// Unified renders d as text, one line per diff line starting with its
// op and a space, keeping at most context unchanged lines around each
// change ("  …" marks the lines left out).
func Unified(d []Line, context int) string {
	keep := make([]bool, len(d))
	for i, l := range d {
		if l.Op == ' ' {
			continue
		}
		for k := max(0, i-context); k <= min(len(d)-1, i+context); k++ {
			keep[k] = true
		}
	}
	var b strings.Builder
	skipped := false
	for i, l := range d {
		if !keep[i] {
			if !skipped {
				b.WriteString("  …\n")
				skipped = true
			}
			continue
		}
		skipped = false
		b.WriteByte(l.Op)
		b.WriteByte(' ')
		b.WriteString(l.Text)
		b.WriteByte('\n')
	}
	return b.String()
}
