package cloudevent

import (
	"sort"
	"strings"

	"github.com/millwright/millwright/metadata"
)

// metadataPrefix is the prefix of CloudEvents attributes in Watermill
// metadata (metadata.EventID is "ce_id").
const metadataPrefix = "ce_"

// Binding names CloudEvents attributes on one protocol's wire in binary
// content mode. The transports use it in their marshalers: WireKey on
// publish, MetadataKey on consume. Keys that are not CloudEvents attributes
// pass through unchanged in both directions.
type Binding struct {
	// Prefix is put before an attribute name on the wire ("ce_", "ce-",
	// "cloudEvents:").
	Prefix string
	// ContentType is the wire key that carries datacontenttype instead of
	// Prefix+"datacontenttype", or "" when the protocol carries it outside
	// the headers (AMQP's content-type property).
	ContentType string
	// AcceptPrefixes are further prefixes recognised on consume (older
	// revisions of the binding).
	AcceptPrefixes []string
	// CaseInsensitive makes MetadataKey ignore case in prefixes and in the
	// content-type key, as the Pub/Sub binding says attribute names are.
	CaseInsensitive bool
}

// The bindings of the CloudEvents 1.0 protocol binding specifications.
var (
	// Kafka: headers "ce_<attr>", datacontenttype in "content-type"
	// (Kafka protocol binding 3.2.3).
	Kafka = Binding{Prefix: "ce_", ContentType: "content-type"}
	// AMQP: application properties "cloudEvents:<attr>", datacontenttype in
	// the message's content-type property (AMQP protocol binding 3.1.1,
	// 3.1.3.1). "cloudEvents_" (the JMS-friendly prefix of earlier drafts)
	// is accepted on consume.
	AMQP = Binding{Prefix: "cloudEvents:", AcceptPrefixes: []string{"cloudEvents_"}}
	// PubSub: attributes "ce-<attr>", datacontenttype in the "Content-Type"
	// attribute; names are case-insensitive (Pub/Sub protocol binding 3.1.1,
	// 3.1.3.1). "ce-datacontenttype", shown in that spec's example, is
	// accepted on consume.
	PubSub = Binding{Prefix: "ce-", ContentType: "Content-Type", CaseInsensitive: true}
	// NATS: headers "ce-<attr>", datacontenttype in the "content-type"
	// header (NATS protocol binding 1.0.1, 3.1.3.1, binary mode). NATS
	// headers keep their case as sent.
	NATS = Binding{Prefix: "ce-", ContentType: "content-type"}
)

// WireKey returns the wire name of metadata key k: a CloudEvents attribute
// key ("ce_<attr>") becomes Prefix+"<attr>" (datacontenttype becomes
// ContentType; with an empty ContentType it returns "", meaning the caller
// carries it elsewhere); any other key is returned unchanged.
func (b Binding) WireKey(k string) string {
	if k == metadata.EventDataContentType {
		if b.ContentType == "" {
			return ""
		}
		return b.ContentType
	}
	if attr, ok := strings.CutPrefix(k, metadataPrefix); ok && attr != "" {
		return b.Prefix + attr
	}
	return k
}

// MetadataKey returns the metadata key of wire key w: the inverse of
// WireKey. Attribute names are lower-cased (CloudEvents attribute names are
// lower-case by definition); other keys are returned unchanged.
func (b Binding) MetadataKey(w string) string {
	if b.ContentType != "" && b.eq(w, b.ContentType) {
		return metadata.EventDataContentType
	}
	for _, p := range append([]string{b.Prefix}, b.AcceptPrefixes...) {
		if len(w) > len(p) && b.eq(w[:len(p)], p) {
			return metadataPrefix + strings.ToLower(w[len(p):])
		}
	}
	return w
}

func (b Binding) eq(x, y string) bool {
	if b.CaseInsensitive {
		return strings.EqualFold(x, y)
	}
	return x == y
}

// Decode renames md's wire keys to metadata keys in place (MetadataKey on
// every key). When two wire keys map to one metadata key, the one already
// named as the metadata key loses to the wire form, the ContentType key
// wins over a prefixed datacontenttype, and among several wire forms of one
// attribute ("ce-ID" and "ce-id" on case-insensitive Pub/Sub) the last in
// byte order wins, so the result never depends on map order.
func (b Binding) Decode(md map[string]string) {
	type rename struct{ from, to string }
	var rs []rename
	for k := range md {
		if mk := b.MetadataKey(k); mk != k {
			rs = append(rs, rename{k, mk})
		}
	}
	// The content-type key is the binding's own carrier of
	// datacontenttype: it wins over a prefixed duplicate.
	sort.Slice(rs, func(i, j int) bool {
		ci, cj := b.ContentType != "" && b.eq(rs[i].from, b.ContentType), b.ContentType != "" && b.eq(rs[j].from, b.ContentType)
		if ci != cj {
			return cj
		}
		return rs[i].from < rs[j].from
	})
	for _, r := range rs {
		md[r.to] = md[r.from]
		delete(md, r.from)
	}
}
