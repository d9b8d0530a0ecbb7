package kafka

import (
	"bufio"
	"encoding/hex"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
)

// JavaVector is one line of testdata/murmur2_java.tsv: what the Apache
// Kafka Java client computes for a key (exported for package kafka_test).
type JavaVector struct {
	Key        []byte
	Murmur2    int32           // Utils.murmur2(key)
	ToPositive int32           // Utils.toPositive(murmur2)
	Partition  map[int32]int32 // BuiltInPartitioner.partitionForKey(key, n)
}

// javaVectorPartitions are the partition counts of the file's last columns.
var javaVectorPartitions = []int32{3, 8, 12}

// ReadJavaVectors reads testdata/murmur2_java.tsv.
func ReadJavaVectors(t testing.TB) []JavaVector {
	t.Helper()
	f, err := os.Open("testdata/murmur2_java.tsv")
	require.NoError(t, err)
	defer f.Close()
	var out []JavaVector
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		cols := strings.Split(line, "\t")
		require.Len(t, cols, 3+len(javaVectorPartitions), "line %q", line)
		var v JavaVector
		if cols[0] != "-" {
			v.Key, err = hex.DecodeString(cols[0])
			require.NoError(t, err)
		}
		num := func(s string) int32 {
			n, err := strconv.ParseInt(s, 10, 32)
			require.NoError(t, err, "line %q", line)
			return int32(n)
		}
		v.Murmur2, v.ToPositive = num(cols[1]), num(cols[2])
		v.Partition = map[int32]int32{}
		for i, n := range javaVectorPartitions {
			v.Partition[n] = num(cols[3+i])
		}
		out = append(out, v)
	}
	require.NoError(t, sc.Err())
	require.GreaterOrEqual(t, len(out), 20, "testdata/murmur2_java.tsv is short")
	return out
}

func TestMurmur2MatchesTheJavaClient(t *testing.T) {
	t.Parallel()

	vectors := ReadJavaVectors(t)
	p := newMurmur2Partitioner("t")
	for _, v := range vectors {
		name := hex.EncodeToString(v.Key)
		if len(name) > 16 {
			name = name[:16] + "..."
		}
		require.Equal(t, v.Murmur2, int32(murmur2(v.Key)), "murmur2 of %s", name)
		for n, want := range v.Partition {
			require.Equal(t, v.ToPositive%n, want, "the file's own formula, key %s", name)
			require.Equal(t, want, partitionForKey(v.Key, n), "key %s, %d partitions", name, n)
			// Through Sarama's interface, as the producer calls it; an
			// empty key is a key (the Java client hashes it too).
			got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(append([]byte{}, v.Key...))}, n)
			require.NoError(t, err)
			require.Equal(t, want, got, "Partition, key %s, %d partitions", name, n)
		}
	}
}

// franz-go's partitioner is an implementation of the Java client's formula
// written independently of ours; compare on many random keys.
func TestMurmur2MatchesFranzGo(t *testing.T) {
	t.Parallel()

	franz := kgo.StickyKeyPartitioner(nil).ForTopic("t")
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 20000; i++ {
		key := make([]byte, rng.IntN(70))
		for j := range key {
			key[j] = byte(rng.Uint32())
		}
		// With math.MaxInt32 partitions the partition is the 31-bit hash
		// itself (but for one value), so this compares the hashes too.
		for _, n := range []int32{1, 2, 3, 8, 12, 100, 1000, math.MaxInt32} {
			want := franz.Partition(&kgo.Record{Key: key}, int(n))
			require.Equal(t, int32(want), partitionForKey(key, n), "key %x, %d partitions", key, n)
		}
	}
}

func TestMurmur2PartitionerRequiresConsistencyForKeysOnly(t *testing.T) {
	t.Parallel()

	p := newMurmur2Partitioner("t")
	require.True(t, p.RequiresConsistency())
	dyn, ok := p.(sarama.DynamicConsistencyPartitioner)
	require.True(t, ok, "keyless messages should be free to avoid an unavailable partition")
	require.True(t, dyn.MessageRequiresConsistency(&sarama.ProducerMessage{Key: sarama.StringEncoder("k")}))
	require.False(t, dyn.MessageRequiresConsistency(&sarama.ProducerMessage{}))
}

// A message without a key goes to a random partition, as with Sarama's
// hash partitioner, not to the partition of some fixed hash.
func TestMurmur2PartitionerSpreadsKeylessMessages(t *testing.T) {
	t.Parallel()

	p := newMurmur2Partitioner("t")
	seen := map[int32]int{}
	for i := 0; i < 2000; i++ {
		got, err := p.Partition(&sarama.ProducerMessage{}, 8)
		require.NoError(t, err)
		require.True(t, got >= 0 && got < 8, "partition %d of 8", got)
		seen[got]++
	}
	require.Len(t, seen, 8, "2000 keyless messages reached only partitions %v", seen)
}

func TestConfigPartitionerAndVersion(t *testing.T) {
	t.Parallel()

	keys := []string{"order-1", "order-2", "customer:42", "ключ", "日本語", "a", "ab", "abc"}
	placement := func(pc sarama.PartitionerConstructor) []int32 {
		p := pc("t")
		var out []int32
		for _, k := range keys {
			got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(k)}, 12)
			require.NoError(t, err)
			out = append(out, got)
		}
		return out
	}
	java := make([]int32, len(keys))
	for i, k := range keys {
		java[i] = partitionForKey([]byte(k), 12)
	}
	fnv := placement(sarama.NewHashPartitioner)
	require.NotEqual(t, java, fnv, "the keys should tell the two partitioners apart")

	cases := []struct {
		partitioner, version string
		wantPlacement        []int32
		wantVersion          sarama.KafkaVersion
	}{
		{"", "", java, sarama.V3_6_0_0},
		{PartitionerMurmur2, "2.3.0", java, sarama.V2_3_0_0},
		{PartitionerMurmur2, "3.6.0", java, sarama.V3_6_0_0},
		{PartitionerFNV1a, "2.1.0", fnv, sarama.V2_1_0_0},
	}
	for _, tc := range cases {
		c := Config{Brokers: []string{"h:9092"}, Partitioner: tc.partitioner, Version: tc.version}
		setDefaults(&c)
		require.NoError(t, validate(c))
		sc, err := saramaConfig(c)
		require.NoError(t, err)
		require.Equal(t, tc.wantVersion, sc.Version, "Version %q", tc.version)
		require.Equal(t, tc.wantPlacement, placement(sc.Producer.Partitioner), "Partitioner %q", tc.partitioner)
	}
}

func TestConfigRejectsUnknownPartitionerAndBadVersion(t *testing.T) {
	t.Parallel()

	cases := []struct {
		cfg  Config
		want []string
	}{
		{Config{Partitioner: "murmur3"}, []string{`Partitioner "murmur3"`, "murmur2", "fnv1a", "MILLWRIGHT_KAFKA_PARTITIONER"}},
		{Config{Partitioner: "Murmur2"}, []string{`Partitioner "Murmur2"`, "want murmur2"}},
		{Config{Version: "3.6"}, []string{`Version "3.6"`, "such as 3.6.0"}},
		{Config{Version: "latest"}, []string{`Version "latest"`}},
		{Config{Version: "0.10.2.0"}, []string{`Version "0.10.2.0"`, "0.11.0.0 or later"}},
	}
	for _, tc := range cases {
		tc.cfg.Brokers = []string{"h:9092"}
		err := tc.cfg.Validate()
		require.Error(t, err, "%+v", tc.cfg)
		for _, w := range tc.want {
			require.Contains(t, err.Error(), w)
		}
	}
}
