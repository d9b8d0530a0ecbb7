package metadata_test

import (
	"maps"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
)

func TestPackBinaryRoundTrips(t *testing.T) {
	t.Parallel()
	md := map[string]string{"ok": "text", "key\x0a\xff\x01": "v", "header": "value\xff\x00", "ordering_key": "\xff\xfe"}
	packed := metadata.PackBinary(md)
	require.Equal(t, "text", packed["ok"])
	for k, v := range packed {
		require.True(t, metadata.IsText(k) && metadata.IsText(v), "packed %q=%q is text", k, v)
	}
	require.Len(t, md, 4, "md is not changed")
	got := maps.Clone(packed)
	require.NoError(t, metadata.UnpackBinary(got))
	require.Equal(t, md, got)

	plain := map[string]string{"a": "b"}
	require.Equal(t, plain, metadata.PackBinary(plain))
	require.NoError(t, metadata.UnpackBinary(plain))
	require.Equal(t, map[string]string{"a": "b"}, plain)

	bad := map[string]string{metadata.BinaryEntries: "AQ=="} // a length with no bytes after it
	require.ErrorIs(t, metadata.UnpackBinary(bad), metadata.ErrBinaryEntries)
	require.Contains(t, bad, metadata.BinaryEntries, "left as it was")
}

func FuzzUnpackBinary(f *testing.F) {
	f.Add("AQ==")
	f.Add(metadata.PackBinary(map[string]string{"k": "\xff"})[metadata.BinaryEntries])
	f.Fuzz(func(t *testing.T, enc string) {
		md := map[string]string{metadata.BinaryEntries: enc, "x": "y"}
		if err := metadata.UnpackBinary(md); err != nil {
			require.Equal(t, enc, md[metadata.BinaryEntries])
		}
	})
}
