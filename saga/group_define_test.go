package saga_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/saga"
)

func TestDefineRejectsInvalidGroups(t *testing.T) {
	t.Parallel()
	cmd := func(struct{}) (saga.Command, error) { return saga.Command{Topic: "t"}, nil }
	br := func(name string) saga.Step[struct{}] {
		return saga.Step[struct{}]{Name: name, Command: cmd, Compensation: cmd}
	}
	type steps = []saga.Step[struct{}]
	for name, tc := range map[string]struct {
		steps steps
		want  string
	}{
		"one branch": {steps: steps{{Name: "g", Parallel: steps{br("a")}}}, want: `step 0 ("g"): Parallel has 1 branch(es): a group needs at least 2`},
		"no branch":  {steps: steps{{Name: "g", Parallel: steps{}}}, want: `Parallel has 0 branch(es)`},
		"group with command": {steps: steps{{Name: "g", Command: cmd, Parallel: steps{br("a"), br("b")}}},
			want: `step 0 ("g"): a group (Parallel set) sends no command of its own, but Command is set`},
		"group with compensation and timeout": {steps: steps{{Name: "g", Compensation: cmd, Timeout: time.Second, Parallel: steps{br("a"), br("b")}}},
			want: `but Compensation, Timeout are set`},
		"nested group": {steps: steps{{Name: "g", Parallel: steps{br("a"), {Name: "h", Parallel: steps{br("b"), br("c")}}}}},
			want: `branch 1 ("h"): Parallel is set: a branch cannot itself be a group`},
		"branch name used by a step": {steps: steps{br("a"), {Name: "g", Parallel: steps{br("a"), br("b")}}},
			want: `branch 0: Name "a" is used by an earlier step or branch`},
		"branch names repeated": {steps: steps{{Name: "g", Parallel: steps{br("a"), br("b")}}, {Name: "h", Parallel: steps{br("b"), br("c")}}},
			want: `step 1 ("h") branch 0: Name "b" is used by an earlier step or branch`},
		"group name used by a step": {steps: steps{{Name: "g", Parallel: steps{br("a"), br("b")}}, br("g")},
			want: `group "g": Name is also used by another step, branch or group`},
		"branch without compensation": {steps: steps{{Name: "g", Parallel: steps{br("a"), {Name: "b", Command: cmd}}}},
			want: `step "b": no Compensation`},
		"branch without command": {steps: steps{{Name: "g", Parallel: steps{br("a"), {Name: "b", NoCompensation: true}}}},
			want: `step "b": Command is nil`},
	} {
		t.Run(name, func(t *testing.T) {
			d, err := saga.Define("x", tc.steps...)
			require.ErrorContains(t, err, tc.want)
			require.Nil(t, d)
		})
	}
	d, err := saga.Define("x", br("first"), saga.Step[struct{}]{Name: "g", Parallel: steps{br("a"), br("b")}}, br("last"))
	require.NoError(t, err)
	require.Equal(t, []string{"first", "a", "b", "last"}, d.Steps())
}

func TestMermaidDrawsGroups(t *testing.T) {
	t.Parallel()
	cmd := func(struct{}) (saga.Command, error) { return saga.Command{Topic: "t"}, nil }
	d := saga.MustDefine("x",
		saga.Step[struct{}]{Name: "first", Command: cmd, Compensation: cmd},
		saga.Step[struct{}]{Name: "g", Parallel: []saga.Step[struct{}]{
			{Name: "a", Command: cmd, Compensation: cmd, Timeout: time.Second},
			{Name: "b", Command: cmd, NoCompensation: true, Timeout: time.Second}}},
		saga.Step[struct{}]{Name: "last", Command: cmd, NoCompensation: true})
	m := d.Mermaid()
	for _, want := range []string{
		"    first --> g: first.succeeded\n",
		"    state g {\n",
		"        state g_fork <<fork>>\n",
		"        g_fork --> a\n",
		"        g_fork --> b\n",
		"        a --> g_join: a.succeeded, a.failed or timeout 1s\n",
		"    g --> last: every branch succeeded\n",
		"    g --> undo_a: a branch failed or timed out\n",
		"    g --> undo_first: a branch failed or timed out\n",
		"    last --> undo_a: last.failed\n",
		"    undo_a --> undo_first: a.compensated\n",
		"    undo_first --> Compensated: first.compensated\n",
	} {
		require.Contains(t, m, want)
	}
}
