package io.github.millwright.connect;

import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import org.apache.kafka.common.config.AbstractConfig;
import org.apache.kafka.common.config.ConfigDef;
import org.apache.kafka.connect.connector.ConnectRecord;
import org.apache.kafka.connect.data.Schema;
import org.apache.kafka.connect.errors.DataException;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.header.Headers;
import org.apache.kafka.connect.transforms.Transformation;


/**
 * Replaces the header named by {@code header} (default
 * {@code millwright_headers}), whose value is a JSON object of strings, by
 * one string header per key, in the object's order. A record without that
 * header passes unchanged (Debezium's heartbeats). A value that is not an
 * object of strings fails the record: publishing it without its headers
 * would hand consumers a different message than millwright's relay does.
 */
public class ExpandHeaders<R extends ConnectRecord<R>> implements Transformation<R> {
    public static final String HEADER_CONFIG = "header";
    private static final ConfigDef CONFIG = new ConfigDef().define(HEADER_CONFIG, ConfigDef.Type.STRING,
            "millwright_headers", ConfigDef.Importance.HIGH,
            "The header holding the JSON object of headers to add (the outbox's wire_headers column).");
    private static final ObjectMapper JSON = new ObjectMapper();

    private String header;

    @Override
    public void configure(Map<String, ?> props) {
        header = new AbstractConfig(CONFIG, props).getString(HEADER_CONFIG);
    }

    @Override
    public R apply(R record) {
        Header h = record.headers().lastWithName(header);
        if (h == null) {
            return record;
        }
        Headers out = record.headers().duplicate();
        out.remove(header);
        Object v = h.value();
        if (v != null) {
            String text = v instanceof byte[] ? new String((byte[]) v, StandardCharsets.UTF_8) : v.toString();
            expand(text, out);
        }
        return record.newRecord(record.topic(), record.kafkaPartition(), record.keySchema(), record.key(),
                record.valueSchema(), record.value(), record.timestamp(), out);
    }

    private void expand(String text, Headers out) {
        try (JsonParser p = JSON.createParser(text)) {
            if (p.nextToken() != JsonToken.START_OBJECT) {
                throw new DataException("header " + header + " is not a JSON object: " + text);
            }
            while (p.nextToken() == JsonToken.FIELD_NAME) {
                String name = p.currentName();
                if (p.nextToken() != JsonToken.VALUE_STRING) {
                    throw new DataException("header " + header + ": key " + name + " is not a string");
                }
                out.add(name, p.getText(), Schema.STRING_SCHEMA);
            }
        } catch (IOException e) {
            throw new DataException("header " + header + " is not valid JSON: " + e.getMessage(), e);
        }
    }

    @Override
    public ConfigDef config() {
        return CONFIG;
    }

    @Override
    public void close() {
    }
}
