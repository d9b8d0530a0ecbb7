package relay

import (
	"strconv"

	"github.com/millwright/millwright/internal/storage"
)

// Names the tests use for statements that now live in the storage layer.
var (
	claimSQL         = storage.OutboxClaimSQL
	notifyChannelSQL = storage.OutboxNotifyChannelSQL
)

const (
	laneExpr      = storage.OutboxLaneExpr
	wakeLockClass = storage.OutboxWakeLockClass
)

// intArrayParam renders lanes (or shares) as the text of an int[] literal.
func intArrayParam(lanes []int32) string {
	b := make([]byte, 0, 4*len(lanes)+2)
	b = append(b, '{')
	for i, l := range lanes {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(l), 10)
	}
	return string(append(b, '}'))
}
