package console

import "strings"

// ChangeLines splits an audit row's change (audit.Entry.Change: lines
// starting with "  ", "- " or "+ ", and "payload:"/"metadata:" headings)
// into lines the audit page draws as a diff.
func (v *view) ChangeLines(change string) []diffLine {
	var out []diffLine
	for _, l := range strings.Split(strings.TrimRight(change, "\n"), "\n") {
		switch {
		case strings.HasPrefix(l, "+ "), strings.HasPrefix(l, "- "):
			out = append(out, diffLine{Op: l[:1], Text: l[2:]})
		case strings.HasPrefix(l, "  "):
			out = append(out, diffLine{Op: " ", Text: l[2:]})
		default: // a heading
			out = append(out, diffLine{Op: "", Text: l})
		}
	}
	return out
}
